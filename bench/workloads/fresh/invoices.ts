// Invoices for the studio's clients: lines, totals with tax, and reminders for late ones.

export type Currency = "EUR" | "GBP" | "USD";

export interface Line {
  description: string;
  hours: number;
  ratePerHour: number;
}

export interface Invoice {
  number: string;
  client: string;
  currency: Currency;
  issuedOn: Date;
  dueInDays: number;
  lines: Line[];
  paid: boolean;
}

const TAX_RATE = 0.21;
const DAY_MS = 24 * 60 * 60 * 1000;

export function subtotal(invoice: Invoice): number {
  return invoice.lines.reduce((sum, line) => sum + line.hours * line.ratePerHour, 0);
}

export function tax(invoice: Invoice): number {
  return Math.round(subtotal(invoice) * TAX_RATE * 100) / 100;
}

export function total(invoice: Invoice): number {
  return subtotal(invoice) + tax(invoice);
}

export function dueDate(invoice: Invoice): Date {
  return new Date(invoice.issuedOn.getTime() + invoice.dueInDays * DAY_MS);
}

export function isOverdue(invoice: Invoice, today: Date): boolean {
  return !invoice.paid && today.getTime() > dueDate(invoice).getTime();
}

export function daysLate(invoice: Invoice, today: Date): number {
  if (!isOverdue(invoice, today)) {
    return 0;
  }
  return Math.floor((today.getTime() - dueDate(invoice).getTime()) / DAY_MS);
}

export function format(amount: number, currency: Currency): string {
  const symbols: Record<Currency, string> = { EUR: "€", GBP: "£", USD: "$" };
  return `${symbols[currency]}${amount.toFixed(2)}`;
}

export function reminder(invoice: Invoice, today: Date): string | null {
  const late = daysLate(invoice, today);
  if (late === 0) {
    return null;
  }
  const amount = format(total(invoice), invoice.currency);
  return (
    `Dear ${invoice.client}, invoice ${invoice.number} for ${amount} ` +
    `was due ${late} day${late === 1 ? "" : "s"} ago. Please pay at your earliest convenience.`
  );
}

export function overdue(invoices: Invoice[], today: Date): Invoice[] {
  return invoices
    .filter((invoice) => isOverdue(invoice, today))
    .sort((a, b) => daysLate(b, today) - daysLate(a, today));
}
